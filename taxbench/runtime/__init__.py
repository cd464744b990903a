"""What an arm's determinism policy does to this process (environment and torch's flags) and what torch reports back;
the policy itself (its fields, validation, what it sets, its audit) is taxbench.config.policy, torch-free."""
