"""The front end, in every API server process (or the offline LLM's): tokenization and
validation (input processor), detokenization, stop strings and request outputs (output
processor), and the clients that talk to the engine core, in this process or in its own.
It runs no model: everything it tells the core, and hears back, is a `core_messages` message."""
