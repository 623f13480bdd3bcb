"""Execution: the model runner, its persistent input batch, sampler, attention backends,
models and CUDA graphs. It reads a SchedulerOutput and returns a ModelRunnerOutput
(engine/step_io.py) and knows nothing of scheduling."""
