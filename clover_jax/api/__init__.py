"""What users hold: `CloverModel` (`clover_model`, the one place that joins loading, the model and
decoding), the tokenizer and chat template (`tokenization`) and the command line (`cli`)."""
