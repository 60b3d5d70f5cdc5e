"""Mutant: evaluation passes are padded again (sharded as training passes: repeated samples)."""

from lite_core.data import _sharding as _data

_data.distribute_for_evaluation = _data.distribute
