"""The module inside DistributedDataParallel / DataParallel wrappers: the one unwrap helper."""
from torch.nn.parallel import DataParallel, DistributedDataParallel

__all__ = ["unwrap"]


def unwrap(model):
    """The module inside (possibly nested) DistributedDataParallel / DataParallel wrappers."""
    while isinstance(model, (DistributedDataParallel, DataParallel)):
        model = model.module
    return model
