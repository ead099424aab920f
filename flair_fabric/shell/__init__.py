"""``python -m flair_fabric train CONFIG``: a training run described by a YAML config, parsed with jsonargparse.

Two passes, so that the common mistakes answer at once: :mod:`~flair_fabric.shell.options` checks the config's
layout and the trainer's keys without importing torch or flair; :mod:`~flair_fabric.shell.components` then imports
the classes the config names, checks their arguments and makes the corpus, the model and the plugins.
"""
