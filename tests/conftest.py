"""One compute thread in the test process too, as in every worker it starts: a reference
gradient summed by two threads rounds differently from a stage's one-thread sum, and the
suite must give the same answer whether or not OMP_NUM_THREADS=1 is set."""

import torch

torch.set_num_threads(1)
