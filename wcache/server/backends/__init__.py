"""Slab backends: ``host`` (memfd shared memory) and ``cuda`` (CUDA IPC / VMM)."""
