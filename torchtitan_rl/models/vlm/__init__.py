"""Vision-language model: Mistral3 / Pixtral layout on the Qwen3 decoder (docs/design.md, 'Vision-language model')."""
