#!/bin/bash
printf 'alice\n' > name.txt
