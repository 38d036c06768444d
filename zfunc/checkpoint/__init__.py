"""zf.checkpoint: sharded, atomic save and load of any ``TrainState``, resharding, export, and import.

save_load.py saves and loads; layout.py maps a state's leaves onto a checkpoint; files.py, manifest.py
and disk_io.py are its files on disk; restore.py is the state a load fills, landing.py the memory it
reads into; folder.py owns a folder of checkpoints; background.py saves while
training goes on; importers/ reads DeepSpeed and DCP checkpoints without running their code. ``full_params``
(every param whole on every rank, from any state) is ``zfunc.core.placement``'s, which asks the state's placement.
"""
from zfunc.checkpoint.background import SaveHandle
from zfunc.checkpoint.files import CheckpointError
from zfunc.checkpoint.files import LATEST
from zfunc.checkpoint.folder import checkpoint_path, latest, prune
from zfunc.checkpoint.importers import deepspeed_config, load_dcp, load_deepspeed
from zfunc.checkpoint.layout import BUFFERS, PARAMS
from zfunc.checkpoint.manifest import read_manifest
from zfunc.checkpoint.save_load import export, load, save
from zfunc.core.placement import full_params

__all__ = ["BUFFERS", "CheckpointError", "LATEST", "PARAMS", "SaveHandle", "checkpoint_path", "deepspeed_config",
           "export", "full_params", "latest", "load", "load_dcp", "load_deepspeed", "prune", "read_manifest", "save"]
