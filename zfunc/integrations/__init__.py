"""zfunc.integrations: other people's trainers on zfunc, each an optional extra imported where used.

transformers.py: Hugging Face's ``Trainer`` and ``TrainingArguments`` training through ``zfunc.deepspeed``'s
engine with the ``--deepspeed`` JSON (``pip install zfunc[transformers]``).
"""
