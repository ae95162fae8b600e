"""The cabin-* commands: argparse and the words a user reads, over the library; nothing imports them."""
