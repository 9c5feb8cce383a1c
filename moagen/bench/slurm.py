def main(args):
    raise NotImplementedError
