from services.estimator.service import add_arguments, start
from shared.runner import service_main

service_main("estimator", start, add_arguments)
