"""Build-time tools that are not part of the installed product: AOT kernel compilation
checks and the training of the embedded default model."""
