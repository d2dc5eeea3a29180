"""Starting the ranks: Hydra jobs under DDP, the launcher's environment (torchrun, SLURM), collective timeouts and the signals of a preemption, config resolvers."""
