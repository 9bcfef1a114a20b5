#!/bin/bash
printf 'hello\n' > greeting.txt
