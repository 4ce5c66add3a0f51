"""Shared by the PyTorch peers: the tutorial's BasicNet and MNIST from the repository's IDX files.

torchvision's MNIST reads the decompressed IDX files from <root>/MNIST/raw; they are unpacked once
from data/mnist/*.gz into a cache directory (no network).
"""
import gzip
import os
import pathlib
import shutil

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = pathlib.Path(__file__).resolve().parents[2]
FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]


class BasicNet(nn.Module):
    """PyTorch's MNIST example network (1,199,882 parameters)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def mnist_root():
    """A torchvision root holding MNIST/raw/<the four decompressed files>."""
    src = pathlib.Path(os.environ.get("MNIST_DIR", REPO / "data" / "mnist"))
    root = pathlib.Path(os.environ.get("LADDER_TORCHVISION_ROOT", REPO / "target" / "torchvision-mnist"))
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        dst = raw / name
        if not dst.exists():
            tmp = dst.with_suffix(".tmp")
            with gzip.open(src / (name + ".gz"), "rb") as f, open(tmp, "wb") as g:
                shutil.copyfileobj(f, g)
            os.replace(tmp, dst)
    return str(root)


def datasets():
    from torchvision import datasets, transforms

    t = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    root = mnist_root()
    return datasets.MNIST(root, train=True, download=False, transform=t), datasets.MNIST(
        root, train=False, download=False, transform=t
    )


def evaluate(model, loader):
    model.eval()
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            loss += F.nll_loss(out, y, reduction="sum").item()
            correct += (out.argmax(1) == y).sum().item()
            n += len(y)
    return correct, loss, n
