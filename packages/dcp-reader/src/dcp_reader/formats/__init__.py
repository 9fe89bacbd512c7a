"""Checkpoint formats: each one's metadata parser and data layout (native, Hugging Face
safetensors, torch.distributed.checkpoint, hyper-parallel)."""
