"""The runtime that runs algorithms: the round loop, the scheduler, message passing, evaluation."""
