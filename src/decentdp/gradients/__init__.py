"""Per-sample gradient engines: the stacked layer rules (ghost clipping), the torch.func fallback, memory planning."""
