"""Pixtral vision encoder (used by the VLM in ``models/vlm``)."""
