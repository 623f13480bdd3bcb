"""The front end, in every API server process (or the offline LLM's): tokenization and
validation (input processor), detokenization, stop strings and request outputs (output
processor), and the clients that talk to the engine core in-process or in its own process.
It knows no model: the core is reached through `core_messages` alone."""
