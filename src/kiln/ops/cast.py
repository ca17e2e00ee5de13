"""Cast ops."""

import torch

from .registry import register
