"""Process-level helpers: supported versions, the CPU guard, a clean multi-process exit."""
