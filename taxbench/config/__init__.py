"""What an experiment is asked to do: the config schema (Hydra/OmegaConf), the determinism policy, pair validation."""
