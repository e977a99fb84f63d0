"""Running an experiment, by phase: build the components, run the rounds, record the results."""
