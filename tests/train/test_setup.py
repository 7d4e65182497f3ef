"""What calibrate and train share (adaptiveload/train/setup.py)."""
import torch

from adaptiveload.train.setup import CPU_THREADS, set_cpu_threads


def test_cpu_jobs_use_one_thread_unless_omp_num_threads_is_set(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        set_cpu_threads(torch.device("cpu"))
        assert torch.get_num_threads() == 2  # the user's setting stands
        monkeypatch.delenv("OMP_NUM_THREADS")
        set_cpu_threads(torch.device("cuda"))
        assert torch.get_num_threads() == 2  # a GPU job keeps torch's default
        set_cpu_threads(torch.device("cpu"))
        assert torch.get_num_threads() == CPU_THREADS == 1
    finally:
        torch.set_num_threads(before)
