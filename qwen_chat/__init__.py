"""Qwen3.5 private multimodal chat service."""
