from services.placer.service import add_arguments, start
from shared.runner import service_main

service_main("placer", start, add_arguments)
