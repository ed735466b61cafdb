"""Vision-language model: Mistral3 / Pixtral layout on the Qwen3 decoder (DESIGN §12)."""
