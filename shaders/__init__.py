"""GLSL compute shaders, their registry and the compiler that turns them into cached SPIR-V."""
