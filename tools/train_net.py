#!/usr/bin/env python
"""Train or evaluate any BRAIxDet stage: the meta-architecture in the config picks the trainer.

  python tools/train_net.py --config-file configs/MVCCL/mvccl_cbis_ddsm.yaml \
      DATASETS.BRAIXDET.ROOT /data/CBIS-DDSM OUTPUT_DIR out/mvccl
  python tools/train_net.py --config-file configs/BRAIxDet/braixdet_cbis_ddsm.yaml \
      --num-gpus 8 DATASETS.BRAIXDET.RATIO 1/8 MODEL.BRAIXDET.INIT_FROM_CLASSIFIER ...
  ... --eval-only MODEL.WEIGHTS out/braixdet/model_final.pth   (evaluates the teacher)
  ... --resume                                                  (continues where it stopped)
"""
from detectron2.engine import default_argument_parser, default_setup, launch

from braixdet.engine import trainer_class
from braixdet.engine.setup import build_cfg, load_inference_weights, register_and_assign_datasets


def setup(args):
    cfg = build_cfg(args.config_file, args.opts)
    register_and_assign_datasets(cfg)
    cfg.freeze()
    default_setup(cfg, args)
    return cfg


def main(args):
    cfg = setup(args)
    Trainer = trainer_class(cfg)
    if args.eval_only:
        model = Trainer.build_model(cfg)
        load_inference_weights(model, cfg.MODEL.WEIGHTS)
        return Trainer.test(cfg, model)
    trainer = Trainer(cfg)
    trainer.resume_or_load(resume=args.resume)
    return trainer.train()


if __name__ == "__main__":
    args = default_argument_parser().parse_args()
    launch(main, args.num_gpus, num_machines=args.num_machines, machine_rank=args.machine_rank,
           dist_url=args.dist_url, args=(args,))
