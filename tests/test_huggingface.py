"""A Hugging Face Trainer script with goodput's one callback, run as a worker is (the contract's
environment, in a subprocess): it reports throughput and gradient noise, stops on SIGTERM with a
checkpoint at GOODPUT_CHECKPOINT and the stopped mark, resumes from it (its steps go on) at another
world size with its batch re-split, and its profiling run prints a profile the profiler accepts."""

import pytest

from tests.test_lightning import check_profiling_run, run_the_pages_script, stop_two_then_resume_one

SCRIPT = '''
import sys

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from goodput_train.huggingface import GoodputCallback


class Tokens(torch.utils.data.Dataset):
    """Sequences of 12 random tokens; the label: whether token 7 occurs in the first half."""

    def __init__(self, n=2048):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, 12), generator=generator)
        self.labels = (self.ids[:, :6] == 7).any(1).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(12, dtype=torch.long), "labels": self.labels[i]}


class Classifier(BertForSequenceClassification):
    def forward(self, input_ids=None, **inputs):
        if self.training and not hasattr(self, "first"):
            self.first = input_ids.shape[0]
            print(f"first batch {self.first}", flush=True)
        return super().forward(input_ids=input_ids, **inputs)


torch.manual_seed(0)
config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                    max_position_embeddings=16, num_labels=2)
args = TrainingArguments(output_dir="out", per_device_train_batch_size=16, max_steps=int(sys.argv[1]), learning_rate=1e-3,
                         save_strategy="no", logging_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, remove_unused_columns=False)
trainer = Trainer(model=Classifier(config), args=args, train_dataset=Tokens())
trainer.add_callback(GoodputCallback(trainer))
trainer.train()
print(f"done at step {trainer.state.global_step}", flush=True)
'''


@pytest.mark.e2e  # it starts workers, as a node agent does
def test_a_trainer_script_reports_stops_on_sigterm_and_resumes_at_another_size_with_its_batch_re_split(tmp_path):
    stop_two_then_resume_one(tmp_path, SCRIPT, "hf-1", 30)


@pytest.mark.e2e  # it starts workers, as a node agent does
def test_a_trainer_profiling_run_prints_a_profile_the_profiler_accepts_and_trains_no_further(tmp_path):
    check_profiling_run(tmp_path, SCRIPT, "hf-2")


@pytest.mark.e2e  # it starts workers, as a node agent does
def test_the_pages_trainer_script_reports_stops_and_resumes_as_written(tmp_path):
    run_the_pages_script(tmp_path, "# train.py: a tiny BERT classifier on generated tokens", "page-hf")
