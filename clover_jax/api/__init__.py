"""What users hold: `CloverModel` (`clover_model`, the one place that joins loading, the model and
decoding), the tokenizer (`tokenization`) and the chat-template sandbox it renders in
(`chat_templates`), and the command line (`cli`)."""
