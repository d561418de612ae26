from leangrpo.cli import main

main()
