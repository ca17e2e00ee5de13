"""control_flow ops."""

import torch

from .registry import register
