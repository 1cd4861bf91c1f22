"""Train or evaluate any BRAIxDet stage (the config picks the trainer, engine/trainers.py):
the pipeline's training stages run ``python -m braixdet.pipeline.train_net``; tools/train_net.py
is the same entry point (its docstring has the commands).

Before anything is written, the main process locks OUTPUT_DIR (a second run on the same folder
is refused) and checks what can be checked before training (datasets non-empty, init files
readable, OUTPUT_DIR writable with room for a checkpoint). A failure ends with one line
``error: ...`` naming its cause; the full traceback goes to OUTPUT_DIR/log.txt.
"""
import logging
import os
import sys
import traceback

from detectron2.engine import default_argument_parser, default_setup, launch
from detectron2.utils import comm
from detectron2.utils.logger import setup_logger

from braixdet.cli import run_tool
from braixdet.config import build_cfg, resolve_cfg
from braixdet.engine import trainer_class
from braixdet.engine.preflight import check_before_training, check_disk_space
from braixdet.utils.checkpoint import load_inference_weights
from braixdet.utils.io import refuse_links
from braixdet.utils.output_lock import acquire_output_lock
from braixdet.utils.runtime import end_distributed

_LOCKS = []  # OUTPUT_DIR locks taken by this process (released by launch_training, else at exit)
_OUTPUT_DIRS = []


def setup(args):
    """The run's config, resolved (datasets, iterations) before detectron2's default_setup
    writes it to OUTPUT_DIR/config.yaml: that file alone reproduces the run."""
    _OUTPUT_DIRS.clear()
    cfg = build_cfg(args.config_file, args.opts)
    if comm.is_main_process() and cfg.OUTPUT_DIR:
        # first: a second run on this OUTPUT_DIR stops here, before any log or checkpoint
        _LOCKS.append(acquire_output_lock(cfg.OUTPUT_DIR))
        # a planted link would make detectron2 (no O_NOFOLLOW) overwrite or append to a file
        # outside the folder through config.yaml, log.txt or metrics.json: refused first
        refuse_links(cfg.OUTPUT_DIR)
    comm.synchronize()  # the other ranks write (log.txt.rankN) only once rank 0 holds it
    # detectron2 configures its own loggers only: ours (schedule, initialisation, exported
    # model, pseudo-labels) go to the console and OUTPUT_DIR/log.txt too
    setup_logger(cfg.OUTPUT_DIR, distributed_rank=comm.get_rank(), name="braixdet")
    cfg.freeze()
    cfg = resolve_cfg(cfg)
    default_setup(cfg, args)
    _OUTPUT_DIRS.append(os.path.abspath(cfg.OUTPUT_DIR or "."))
    return cfg


def main(args):
    try:
        result = _main(args)
    except Exception:
        append_to_log(traceback.format_exc())  # the console gets one line (see cli)
        raise
    end_distributed()
    return result


def _main(args):
    cfg = setup(args)
    Trainer = trainer_class(cfg)
    if comm.is_main_process():
        check_before_training(cfg, resume=args.resume, eval_only=args.eval_only)
    if args.eval_only:
        model = Trainer.build_model(cfg)
        load_inference_weights(model, cfg.MODEL.WEIGHTS)
        return Trainer.test(cfg, model)
    trainer = Trainer(cfg)
    trainer.resume_or_load(resume=args.resume)
    if comm.is_main_process():
        check_disk_space(cfg, trainer)
    return trainer.train()


def append_to_log(text):
    """Append ``text`` to this run's log file (OUTPUT_DIR/log.txt[.rankN]), not the console."""
    if not _OUTPUT_DIRS:
        return  # failed before default_setup: no log file (nothing is written before the lock)
    for h in logging.getLogger("detectron2").handlers:
        stream = getattr(h, "stream", None)
        name = os.path.abspath(str(getattr(stream, "name", "")))
        if stream is not None and name.startswith(os.path.join(_OUTPUT_DIRS[-1], "")):
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):
                pass


def launch_training(argv):
    """Parse ``argv`` and run ``main`` on ``--num-gpus`` processes; OUTPUT_DIR unlocked after."""
    args = default_argument_parser().parse_args(argv)
    try:
        launch(main, args.num_gpus, num_machines=args.num_machines,
               machine_rank=args.machine_rank, dist_url=args.dist_url, args=(args,))
    finally:
        while _LOCKS:
            _LOCKS.pop().release()


def cli(argv=None):
    """Parse ``argv``, run, and return the exit status (1 with one ``error:`` line last, also
    in the run's log file)."""
    return run_tool(launch_training, argv, log=append_to_log)


if __name__ == "__main__":
    sys.exit(cli())
