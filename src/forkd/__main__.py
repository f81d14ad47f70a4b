from forkd.cli.main import main

main()
