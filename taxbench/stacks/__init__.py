"""The training stacks behind one protocol (protocol.TrainingStack): taxbench's own (native), torchtitan (titan),
Megatron-Core (megatron) and DeepSpeed (deepspeed); registry.stack_for picks the one a recipe names."""
