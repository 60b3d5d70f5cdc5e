"""A script that starts `ddp_spawn` at its top level, without `if __name__ == "__main__":`.

    python unguarded_spawn.py

Each spawned rank would import this file and start training again: Lite refuses before starting
any rank.
"""

from lite_core import LightningLite


class Train(LightningLite):
    def run(self) -> int:
        return self.global_rank


print("RESULT", Train(accelerator="cpu", strategy="ddp_spawn", devices=2).run())
