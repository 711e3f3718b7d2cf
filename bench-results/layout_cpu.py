"""The model's memory layout on CPU: a training step (SGD with momentum, cross-entropy, random data) and an
evaluation forward, contiguous against channels_last, in process CPU time. Run from the project directory:
    .venv/bin/python bench-results/layout_cpu.py 1   # threads
Each row: the mean ms of 15 steps after 3 untimed ones, two repetitions of each layout, interleaved."""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import WideResNet  # noqa: E402

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
torch.manual_seed(0)
CONFIGS = {"fashion": (10, 1, 1, 28, 64), "cpu-try": (10, 2, 3, 32, 128), "tiny": (10, 1, 3, 32, 32),
           "wrn16-4": (16, 4, 3, 32, 64)}  # depth, widen factor, channels, size, batch
for name, (depth, width, channels, size, batch) in CONFIGS.items():
    results = {}
    for _ in range(2):
        for layout in (torch.contiguous_format, torch.channels_last):
            model = WideResNet(depth=depth, widen_factor=width, in_channels=channels, num_classes=10)
            model = model.to(memory_format=layout)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            x = torch.randn(batch, channels, size, size).contiguous(memory_format=layout)
            y = torch.randint(0, 10, (batch,))

            def step():
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
            for _ in range(3):
                step()
            start, n = time.process_time(), 15
            for _ in range(n):
                step()
            train_ms = (time.process_time() - start) / n * 1000
            model.eval()
            with torch.inference_mode():
                for _ in range(2):
                    model(x)
                start = time.process_time()
                for _ in range(n):
                    model(x)
            eval_ms = (time.process_time() - start) / n * 1000
            results.setdefault(str(layout), []).append((round(train_ms, 1), round(eval_ms, 1)))
    print(name, results, flush=True)
