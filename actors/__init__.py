"""Actors of the runtime and the backends they drive (numpy and Vulkan)."""
