"""Writing checkpoints: the native format (data files with block checksums, values, the writer
lock) and torch DCP's own format. Imports `storage`, `formats` and the model."""

from ._torch_dcp_writer import CHECKSUMS_FILE, TorchDcpWriter, torch_dcp_own_file
from ._torch_saved import TorchSavedValue

__all__ = ["CHECKSUMS_FILE", "TorchDcpWriter", "TorchSavedValue", "torch_dcp_own_file"]
