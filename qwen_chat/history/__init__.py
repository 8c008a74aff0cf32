"""Conversation history: one JSON file per conversation, images by content hash, per-user folders.

Entry point: ``qwen_chat.history.store.HistoryStore`` (see that module for layout and guarantees).
No torch and no Gradio in this package.
"""
