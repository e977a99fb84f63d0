"""Process-level utilities: the glibc allocator setting and the phase profiler."""
