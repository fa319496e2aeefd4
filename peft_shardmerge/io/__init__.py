"""Reading and writing the safetensors format."""
