"""The engine core process: `EngineCore` (steps the scheduler and the worker), its process
entry (`core_process`), and the control plane it steps: sequences, KV block bookkeeping,
scheduling, beam search, stop rules and the outputs it sends.

The control plane is plain Python and integers (host tensors at most): it runs no kernel
and holds no device tensor, so it can schedule one step ahead of the worker."""
