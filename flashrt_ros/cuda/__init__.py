"""A small CUDA driver toolkit (cuda-python): raw copies, one-node graphs, an NVRTC kernel.

It knows nothing of capsules, sessions or engines: it moves bytes and launches what it is given.
Everything here falls back to torch where the driver bindings are missing (CPU machines, CI).
"""
