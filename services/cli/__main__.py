from baton.services.cli.main import main

main()
