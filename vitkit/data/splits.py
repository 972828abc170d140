"""The one entrance to data: a dataset's splits made ready for one model.

    spec = training_data(cfg.data, img_size=..., in_chans=..., device=...)    # what a run trains and evaluates on
    model = ...                                                               # sized from spec (classes, channels)
    data = prepare(model.config, train=spec.train, val=spec.val, test=spec.test,
                   max_patches=cfg.data.max_patches, aug=cfg.aug, seed=cfg.run.seed)
    data.augment(x, y, g)              # a training batch -> the model's input (augmented, normalised, packed)
    data.transform(data.test)(x)       # an evaluation batch -> the model's input

`prepare` asks each dataset itself (its kind's `decodes`, `for_model`, `in_chans`: `vitkit.data.datasets`) and
applies the grey-to-RGB rule (`image.replicate_channels`) once, so that no caller tests what kind of dataset it
holds. `test_split` is what `vitkit eval` evaluates on, `feature_splits` what `vitkit fewshot` and `vitkit knn`
read.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from .augment import AugConfig, BatchAugment
from .datasets import DataSpec, csv_list, folder_test_split, image_folder, is_shards, load_dataset, split_holdout
from .image import EvalTransform, replicate_channels
from .naflex import PackAugment, PackTransform


@dataclass
class Splits:
    """Datasets ready for one model (`config`): each decoded at its size (files) or held for resizing on the batch
    (in memory), packed at native aspect ratios for `max_patches`, with the channel rule that feeds them to it."""

    config: object  # the model's config: img_size, mean, std, crop_pct, interpolation, patch_size, in_chans
    train: object = None
    val: object = None
    test: object = None
    max_patches: int | None = None  # NaFlex: batches packed at native aspect ratios (None: the model's square size)
    replicate_to: int | None = None  # grey data into an RGB model: its channel repeated this many times
    augment: BatchAugment | PackAugment | None = None  # training batches -> inputs (with `prepare(..., aug=)`)

    @property
    def classes(self) -> list[str]:
        return next(ds for ds in (self.train, self.test, self.val) if ds is not None).classes

    def transform(self, ds) -> EvalTransform | PackTransform:
        """The evaluation transform of `ds` (one of these splits): uint8 batches -> the model's input, normalised with
        the model's mean/std; resized with its evaluation geometry unless the files were decoded at its size."""
        if self.max_patches:
            return PackTransform.for_model(self.config, self.max_patches, sized=ds.decodes, replicate_to=self.replicate_to)
        return EvalTransform.for_model(self.config, replicate_to=self.replicate_to, geometry=not ds.decodes)


def prepare(config, *, train=None, val=None, test=None, max_patches: int | None = None, aug: AugConfig | None = None,
            seed: int = 0) -> Splits:
    """The splits given, as the model of `config` reads them.

    Args:
        config: the model's config.
        train, val, test: datasets of any kind (in memory, files, shards, images of varying sizes), or None.
        max_patches: NaFlex: files decoded at each image's own aspect ratio within this many patches and batches
            packed; images of varying sizes held in memory stay as they are (without it they are squared).
        aug: the training augmentation: with it `Splits.augment` is the training batch transform. Random-resized
            crops of files are cut from the full-resolution image where they are decoded (a small crop of the
            model-size image would be upsampled blur), so the batch transform does not crop them again.
        seed: the run's seed (those crops are drawn from (seed, epoch, index)).
    """
    train, val, test = (ds.for_model(config, max_patches) if ds is not None else None for ds in (train, val, test))
    first = next((ds for ds in (train, test, val) if ds is not None), None)
    replicate = replicate_channels(first.in_chans, config.in_chans) if first is not None else None
    augment = None
    if aug is not None:
        if max_patches:  # every image cropped at its own aspect ratio, on the batch
            augment = PackAugment(max_patches, config.patch_size, config.mean, config.std,
                                  scale=aug.scale if aug.crop == "rrc" else (1.0, 1.0), hflip=aug.hflip, replicate_to=replicate)
        else:
            if train.decodes and aug.crop == "rrc":  # cut where the files are decoded; flips and the rest on the batch
                train = train.with_train_crop(aug.scale, aug.ratio, seed)
                aug = dataclasses.replace(aug, crop="none")
            augment = BatchAugment(aug, tuple(config.img_size), config.mean, config.std, len(train.classes), replicate)
    return Splits(config, train, val, test, max_patches, replicate, augment)


def training_data(d, *, img_size=None, in_chans: int | None = None, device=None) -> DataSpec:
    """A run's data before its model exists (`vitkit.training.config.DataConfig` `d`): the dataset's splits, its
    classes chosen (`d.classes`) and in-memory sets cut for smoke runs (`d.subset`, `d.test_subset`) on `device`,
    and with `d.val_split` a held-out part of the training set as `val`. `img_size` and `in_chans` (a model's
    overrides) size file decoding and ask grey data for RGB."""
    spec = load_dataset(d.dataset, d.data_dir, img_size=img_size, strict_images=d.strict_images, test_dir=d.test_dir,
                        in_chans=in_chans)
    spec.train = spec.train.select(d.classes, d.subset, device)
    spec.test = spec.test.select(d.classes, d.test_subset, device)
    spec.classes = spec.train.classes
    if d.val_split:
        spec.train, spec.val = split_holdout(spec.train, d.val_split)
    return spec


def test_split(config, data: str, *, data_dir: str | None = None, test_dir: str | None = None,
               max_patches: int | None = None) -> Splits:
    """What `vitkit eval` evaluates a checkpoint (`config`) on: a test CSV; an ImageFolder root's evaluation split as
    the trainer chose it (val/, else test/), or the folder itself; `test_dir`; or a named dataset's or shard set's
    test split, whose classes must be the checkpoint's. Decoded and transformed as the checkpoint asks (`Splits`)."""
    names = config.class_names
    src = test_dir or data
    if src.endswith(".csv"):
        test = csv_list(src, classes=names, in_chans=config.in_chans)
    elif test_dir or (Path(data).is_dir() and not is_shards(data)):
        split = None if test_dir else folder_test_split(data)
        test = image_folder(split or src, classes=names, in_chans=config.in_chans)
    else:
        test = load_dataset(data, data_dir).test
        if names and list(names) != list(test.classes):
            raise UsageError(f"the checkpoint's classes {names} differ from {data}'s {test.classes}")
    if config.num_classes != len(test.classes):
        raise UsageError(f"the checkpoint has {config.num_classes} classes, the data {len(test.classes)}")
    return prepare(config, test=test, max_patches=max_patches)


def feature_splits(config, data: str, *, data_dir: str | None = None, train_subset: int | None = None) -> Splits:
    """What `vitkit fewshot` and `vitkit knn` read for a frozen model (`config`): a dataset's train and test splits,
    the training split of an in-memory set cut to `train_subset` images (a fixed shuffle)."""
    spec = load_dataset(data, data_dir, in_chans=None)
    return prepare(config, train=spec.train.select(n=train_subset or None), test=spec.test)
