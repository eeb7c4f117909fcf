"""What generated modules import at run time."""
from .init import init_from, load_data
from .signature import Signature
from .trainer import TrainerBase

__all__ = ["Signature", "TrainerBase", "init_from", "load_data"]
