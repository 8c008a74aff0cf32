"""Conversation history: one JSON file per conversation, images by content hash, per-user folders.

Entry point: ``qwen_chat.history.store.HistoryStore`` (see that module for layout and guarantees).
``conversation_files`` (the files and their format), ``image_folder`` (a user's images), ``records`` (the
saved shapes and the status vocabulary), ``files`` (atomic writes, locks), ``turns`` (the life of one chat
turn: prompt messages, saving a streaming reply, its final status) and ``api_images`` (the API's own image
store, apart from any user's conversations).  No torch and no Gradio in this package.
"""
