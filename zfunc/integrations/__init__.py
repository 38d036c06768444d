"""zfunc.integrations: other people's trainers on zfunc, each an optional extra imported where used.

optimizer.py: the torch optimizer a trainer holds while the engine trains (its lr).
transformers.py: Hugging Face's ``Trainer`` and ``TrainingArguments`` training through ``zfunc.deepspeed``'s
engine with the ``--deepspeed`` JSON (``pip install zfunc[transformers]``).
lightning.py: ``ZfuncStrategy``, for Lightning's ``Trainer(strategy=...)``, over the same engine
(``pip install zfunc[lightning]``).
"""
