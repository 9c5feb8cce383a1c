"""The subcommands of `moagen`, one module each: add_parser(sub) adds its parser to the
command line (moagen.cli), whose `run` the parsed arguments carry."""
