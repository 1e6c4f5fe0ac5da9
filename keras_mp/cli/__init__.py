"""The `keras-mp` command: its subcommands, the demo pipeline, `info`."""

from keras_mp.cli.commands import main
